"""Resume audits: run a training command straight and interrupted, and say whether the resume
was exact (`runner drill`). `outcome` reads what a run left; `script` audits any command."""
