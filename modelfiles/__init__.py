"""Model files: GGUF headers, picking a repository's GGUF set, sizing memory, and the verified download
(SPEC MIR-3). Pure rules both the node agent and the control plane use; HTTP only at the edge (``http.py``,
``download.py``)."""
