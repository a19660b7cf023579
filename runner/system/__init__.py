"""runner/system"""
