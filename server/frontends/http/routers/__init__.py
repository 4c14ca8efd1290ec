"""One APIRouter per resource of the KServe v2 protocol and Triton's extensions, and the OpenAI-compatible routes."""

from . import generate, health, inference, models, openai, repository, settings, shared_memory

ALL = [health.router, models.router, inference.router, repository.router, shared_memory.router, settings.router,
       generate.router, openai.router]
