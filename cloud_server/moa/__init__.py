"""The Mixture-of-Attentions drafter (Zimmer et al., arXiv 2410.03804): model, training, export."""
