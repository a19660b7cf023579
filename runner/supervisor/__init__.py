"""`runner run -- CMD`: supervise a trainer in any language (child process, environment,
adoption of its seed files, restarts, the end of each attempt)."""
