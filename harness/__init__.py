"""Side-by-side comparison runs of servelm against peer servers it starts itself.

The load, the metrics and the named workloads are servelm's own `servelm bench` (servelm/bench/); these scripts
start and stop the servers around it. `harness.llama_server` builds llama.cpp's own
`llama-server` from the llama.cpp source that llama-cpp-python vendors; `harness.compare` runs the
workloads against each server in turn and prints the ratios. See harness/README.md.
"""
