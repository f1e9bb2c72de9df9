"""Code both sides import: draft trees, acceptance rules, the wire codec. No torch here."""
