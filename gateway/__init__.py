"""OpenAI-compatible REST gateway in front of the worker's Generate."""
