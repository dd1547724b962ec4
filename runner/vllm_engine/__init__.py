"""vLLM as an engine backend (`serve --engine vllm`, the optional extra omnistream[vllm]).

config.py (no vllm import): the backend's options and the pinned version; process.py: the
engine process; engine.py: requests on vLLM's AsyncLLM beside the codec stage; hooks.py: the
glue that reads vLLM internals. docs/vllm.md describes it.
"""
