"""What a person sees on stderr: log set-up, the live progress line, transfer progress."""
