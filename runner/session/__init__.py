"""runner/session"""
