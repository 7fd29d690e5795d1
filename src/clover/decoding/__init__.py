"""Pure tensor functions of SPEC §5 (LowConfidence unmasking) and §7 (generation controls), kept free of any
model so that the generation loop, the serving engine and the tests share one definition.
"""
