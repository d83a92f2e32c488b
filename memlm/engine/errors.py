"""The engine's error for unusable input (light: the workers test for it cheaply)."""


class EngineInputError(ValueError):
    """The text given to the engine cannot be used (empty after tokenisation...)."""
