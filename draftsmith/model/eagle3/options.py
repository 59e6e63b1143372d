"""EAGLE-3.1's options, under the names speculators and vLLM use (no torch: the kind and the
config checks read them too)."""

NORM_OPTIONS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
