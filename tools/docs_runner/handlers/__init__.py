"""One handler per kind of block: bash (run), python (run in a worker process), validate (YAML,
Compose, Kubernetes, JSON) and output (expect-output against what a bash block printed)."""
