"""Identity providers: OpenID Connect, LDAP and Active Directory, SCIM, and groups to roles (SPEC ID-1 to ID-4)."""
