"""OpenAI's Responses API (`/v1/responses`): a translator onto the shared chat generation path."""
