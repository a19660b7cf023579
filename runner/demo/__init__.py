"""The built-in demo job: a small GPT-style character model on a generated corpus.

`build_demo` (in `runner.demo.components`) assembles everything `runner demo` and `runner drill`
train; nothing here runs at import time.
"""
