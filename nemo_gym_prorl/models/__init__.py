"""The embedded model: an OpenAI-compatible llama.cpp server with exact token ids and log-probs."""
