"""Models and tokenizers made locally (no model hub): the small quickstart Qwen2 and
its character tokenizer. Shared by both clusters like the weight path; imports only
contracts (and transformers/tokenizers, lazily)."""
