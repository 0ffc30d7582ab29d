"""Anthropic's Messages API (`/v1/messages`): a translator onto the shared chat generation path."""
