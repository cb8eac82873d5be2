"""One file per method, each reading like its row in METHODS.md."""
from grace.compressors.fp16 import FP16, fp16
from grace.compressors.none import NoneCompressor, none
from grace.compressors.onebit import OneBit, onebit
from grace.compressors.qsgd import QSGD, qsgd
from grace.compressors.randomk import RandomK, randomk
from grace.compressors.signsgd import SignSGD, signsgd
from grace.compressors.terngrad import TernGrad, terngrad
from grace.compressors.threshold import Threshold, threshold
from grace.compressors.topk import TopK, topk

__all__ = ["FP16", "NoneCompressor", "OneBit", "QSGD", "RandomK", "SignSGD", "TernGrad", "Threshold",
           "TopK", "fp16", "none", "onebit", "qsgd", "randomk", "signsgd", "terngrad", "threshold", "topk"]
