"""The serving edge: the front (gRPC GenerationService), the OpenAI-compatible HTTP API, backends (in-process or Ray actors), admission and fail-over. Imports loop, planning and specdec."""
