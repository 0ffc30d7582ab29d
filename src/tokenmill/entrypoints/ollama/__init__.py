"""Ollama's HTTP API (`/api/*`) on the same port as the OpenAI one: a translator onto the shared
request path (routes.py), for the clients that speak only Ollama."""
