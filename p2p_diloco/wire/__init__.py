"""The wire layer: payload codecs, Ed25519 identity and signatures, the signed update envelope."""
