"""One file per method, each reading like its row in METHODS.md."""
from grace.compressors.fp16 import FP16, fp16
from grace.compressors.none import NoneCompressor, none
from grace.compressors.randomk import RandomK, randomk
from grace.compressors.threshold import Threshold, threshold
from grace.compressors.topk import TopK, topk

__all__ = ["FP16", "NoneCompressor", "RandomK", "Threshold", "TopK",
           "fp16", "none", "randomk", "threshold", "topk"]
