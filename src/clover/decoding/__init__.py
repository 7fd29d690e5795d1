"""Pure tensor functions for Clover decoding.

Kept free of any model so that the generation loop, the serving engine and the tests share one
definition of the SPEC §5 (LowConfidence unmasking) and §7 (generation controls) arithmetic.
"""
