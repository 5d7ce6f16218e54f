"""Compiled CPU graphs, the CPU analogue of CUDA graphs: inductor artifacts of the forward
(whole, or one per decoder-layer kind), their disk cache, and the capture backend that
builds, binds and checks them (`capture_backend.CompiledGraphBackend`), behind the same capture
interface as CUDA graphs and their emulation (graphs/capture.py)."""
