"""runner/console"""
