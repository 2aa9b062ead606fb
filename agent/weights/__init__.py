"""The node's model weights: the cache of files fetched from the mirror, and local model directories.

The rules about model files themselves (GGUF headers, set picking, sizing, the verified download) are
:mod:`llmgw.modelfiles`, shared with the control plane.
"""
