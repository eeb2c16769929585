# /// script
# requires-python = ">=3.11"
# dependencies = [
#   "torch>=2.9",
#   "transformers>=5.17",
#   "safetensors",
#   "tokenizers",
#   "huggingface_hub",
#   "numpy",
#   "pillow",
#   "av",
#   "fastapi",
#   "uvicorn",
#   "requests",
# ]
# ///
"""serve_clef: serve Clef-Omni decisions from an NVFP4 (ModelOpt) checkpoint on one GPU.

Sections, top to bottom: command line, checkpoint loading, packed experts and their kernels, activation replay,
decisions, HTTP.
"""

# ==== command line ====================================================================================================

# ==== checkpoint loading ==============================================================================================

# ==== packed experts and their kernels ================================================================================

# ==== activation replay (faithful W4A4) ===============================================================================

# ==== decisions =======================================================================================================

# ==== HTTP ============================================================================================================
