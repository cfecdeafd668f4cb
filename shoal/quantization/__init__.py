"""Quantised weights on servers: the formats and their quality order (:mod:`.formats`, pure), and
quantising a span's blocks as they load (:mod:`.weights`, needs ``pip install shoal[quant]``)."""

from shoal.quantization.formats import DEFAULT_MIN_QUALITY, Quantization, parse_min_quality, parse_quantization

__all__ = ["DEFAULT_MIN_QUALITY", "Quantization", "parse_min_quality", "parse_quantization"]
