"""rung.graphs: graphs of the forward for a ladder of padded sizes: the ladder, the dispatcher,
the graph manager and builder, and the capture backends (capture.py: CUDA graphs and their
emulation; cpu_compiled/: compiled CPU graphs), behind one interface."""
