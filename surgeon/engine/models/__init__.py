"""The engine's model definitions: plain math over a paged KV cache (cf. nano-vllm's models/)."""
