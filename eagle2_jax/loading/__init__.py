"""From files to params: Hugging Face directories and safetensors, GGUF, Hub ids, the named targets
and their shipped tokenizers, the declarative conversion tables, and the draft-head formats (EAGLE-1/2,
EAGLE-3, Orbax, ours)."""
