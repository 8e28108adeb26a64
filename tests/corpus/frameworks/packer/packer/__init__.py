"""packer: a trainer that packs the non-padding tokens of a batch into one reusable buffer."""
