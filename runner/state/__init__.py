"""runner/state"""
