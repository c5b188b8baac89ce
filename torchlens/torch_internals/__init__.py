"""Every place torchlens reads or patches torch's private internals; `seams.SEAMS` lists them."""
