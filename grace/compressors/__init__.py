"""One file per method, each reading like its row in docs/methods.md."""
from grace.compressors.adaq import AdaQ, adaq
from grace.compressors.dgc import DGC, dgc
from grace.compressors.efsignsgd import EFSignSGD, efsignsgd
from grace.compressors.fp16 import FP16, fp16
from grace.compressors.inceptionn import Inceptionn, inceptionn
from grace.compressors.natural import Natural, natural
from grace.compressors.none import NoneCompressor, none
from grace.compressors.onebit import OneBit, onebit
from grace.compressors.powersgd import PowerSGD, powersgd
from grace.compressors.qsgd import QSGD, qsgd
from grace.compressors.randomk import RandomK, randomk
from grace.compressors.signsgd import SignSGD, signsgd
from grace.compressors.signum import Signum, signum
from grace.compressors.sketchml import SketchML, sketchml
from grace.compressors.terngrad import TernGrad, terngrad
from grace.compressors.threshold import Threshold, threshold
from grace.compressors.topk import TopK, topk
from grace.compressors.u8bit import U8Bit, u8bit

__all__ = ["AdaQ", "DGC", "EFSignSGD", "FP16", "Inceptionn", "Natural", "NoneCompressor", "OneBit",
           "PowerSGD", "QSGD", "RandomK", "SignSGD", "Signum", "SketchML", "TernGrad", "Threshold", "TopK",
           "U8Bit", "adaq", "dgc", "efsignsgd", "fp16", "inceptionn", "natural", "none", "onebit", "powersgd",
           "qsgd", "randomk", "signsgd", "signum", "sketchml", "terngrad", "threshold", "topk", "u8bit"]
