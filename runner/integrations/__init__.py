"""Callbacks for the trainers people already use: the framework keeps its own loop and its own
checkpoint format, spot-runner adds the agreed stop, the verified commit, the mirror and the
resume (runner.integrations.spot). Each framework module imports its framework; nothing here
imports one at `import runner.integrations`."""
