"""runner/supervisor"""
