"""runner/metrics"""
