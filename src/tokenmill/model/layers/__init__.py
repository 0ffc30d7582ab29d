"""Linear and embedding layers: dense (fp32, with a bf16 copy in fast mode) and quantized, chosen by
`make_linear` / `make_embedding` from the weights and the engine's precision."""
