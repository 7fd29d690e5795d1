"""Transformers integration (the model card's Hugging Face quick start).

`clover export SRC DST` (`clover.hf.export.export`) writes a model directory that
`AutoModelForCausalLM.from_pretrained(DST, trust_remote_code=True)` loads without clover installed.
`configuration_clover.py` and `modeling_clover.py` here are the remote code's entry files; inside the
package they also work directly (`clover.hf.modeling_clover.CloverForCausalLM.from_pretrained(DST)`).
Importing this package does not import transformers.
"""

from .export import ExportError, export as export_model, main, write_remote_code

__all__ = ["ExportError", "export_model", "main", "write_remote_code"]
