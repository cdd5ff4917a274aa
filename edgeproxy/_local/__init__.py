"""The local llama.cpp model: request mapping, binding, prompt fitting, generation, answers."""
