"""runner/atomicity"""
