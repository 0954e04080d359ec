"""tokengym.policies: policy adapters that generate assistant token ids from token contexts.

The adapters (vLLM, transformers, OpenAI-compatible servers, scripted) land here; this
package deliberately knows nothing of the environments.
"""

__all__: list[str] = []
