"""The local llama.cpp model: request mapping, binding, scheduling, answers."""
