"""Graph passes of fxremat, in pipeline order: trace, profile, rewrite."""
