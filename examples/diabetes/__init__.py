"""scikit-learn's diabetes data (442 patients, 10 baseline features, disease progression after a
year)."""
