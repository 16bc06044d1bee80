"""Knowledge bases: git-synced markdown vaults with an ontology (the knowledge-server seed), per organization."""
