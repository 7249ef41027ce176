"""Graph passes of fxremat, in pipeline order: trace (or capture), profile (and calibrate), lower,
rewrite; partition runs later, inside ``torch.compile``, on the joint graph of the emitted code."""
