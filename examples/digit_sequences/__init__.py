"""scikit-learn's 8x8 digits read as token sequences: each pixel's intensity (0..16) is a token."""
