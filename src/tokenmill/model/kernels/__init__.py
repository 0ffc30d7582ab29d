"""C++ CPU kernels (sources in model/csrc/), built on first use, and their thin Python wrappers."""
