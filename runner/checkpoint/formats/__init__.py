"""runner/checkpoint/formats"""
