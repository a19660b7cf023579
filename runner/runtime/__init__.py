"""runner/runtime"""
